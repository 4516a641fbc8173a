"""The harness between the decoding core and the entry points: Spec-Bench workloads, measuring methods side by
side, identity checks, Parquet traces, reports and plots, and the Hugging Face peer."""
