"""Drafters: propose, then learn from the verdict. The interface (``base``), drafting a chain or a tree with a model
(``drafting``) and the model-based drafters (``ngram``, ``draft_model``, ``early_exit``, ``eagle``), the model-free
ones (``recycling``, ``suffix``, ``hybrid``, built by ``model_free``, with their ``draft_memory``) and the trained
ones (``trained``, loaded from ``artifacts``). Each module registers the builders of the methods it drafts for
(``decoding.builders``)."""
