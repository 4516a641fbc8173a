"""The one decoding loop (``loop``): draft, verify with the lossless rules (``verify``), commit; the per-step draft
length from goodput (``goodput``) and the figures of a generation (``metrics``)."""
