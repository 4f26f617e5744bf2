"""Token trees (SpecInfer; Yggdrasil, Guan et al.), in one place: the tree as data (`tree`: parents, depths,
mask, positions, paths), equal-growth drafting (`drafter`; on the device, one graph: `levels`), verify-width
pruning with the latency-aware objective (`prune`), the drafting depth's predictor (`depth`), the shape `auto` sizes
resolve to (`shape`), the decoder (`decoder`) and the `tree` method's options and registration (`method`). Each file
imports only the layers below its own (see docs/architecture.md): the data and the algorithms need no decoder, the
decoder no method.
"""
