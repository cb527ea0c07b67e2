"""The model-state layer: what a live state and its snapshots hold, layer kind by layer kind, and how they
are copied, chained, batched and cut back. Nothing here knows a model family (`hyserve.families` builds on
it); import each name from the module that holds it."""
