"""Drafters: propose, then learn from the verdict. The interface and the model-based drafters (``drafters``), the
model-free ones (``recycling``, ``suffix``, ``hybrid``, built by ``model_free``, with their ``draft_memory``) and the
trained ones (``trained``, loaded from ``artifacts``). Each module registers the builders of the methods it drafts
for (``decoding.builders``)."""
