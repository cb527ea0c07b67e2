"""The model-state layer: what a live state and its snapshots hold, layer kind by layer kind, and how they are
copied, chained along the prefix tree, batched for decode and cut back. Nothing here knows a model family
(`hyserve.families` builds on it). The modules, each importing only modules listed above it:

- `batch_layers`: a decode batch's attention layers, whose KV grows in place;
- `layer_kinds`: one object per kind of cache layer (kv, state, both, none, opaque) carrying its operations;
- `snapshot_blocks`: the recycled blocks of memory snapshots are copied into;
- `caches`: a whole cache's tensors listed, copied and counted, through its layers' kinds;
- `kv_segment`: a piece of attention KV kept along the prefix tree;
- `snapshot`: a live state, a snapshot, the hash of a token prefix;
- `kv_chain`: snapshots whose attention KV is a chain of segments shared along the tree;
- `decode_batch`: many live states decoded in one pass.

Import each name from the module that holds it: this package re-exports nothing, so no module in it can
import it back into a cycle (tests/test_import_graph.py)."""
