"""The model and its cache: run layers a..b of a Hugging Face decoder-only model over a position-addressed KV cache
(``adapter``), the fused fast layers (``fast_layers``), packed 4-bit and int8 weights (``quant``), sparse and retrieval
views of the cache (``kv_views``), and loading a model without a hub (``loading``)."""
