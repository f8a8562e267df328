"""The extraction half: datasets and partitions, frozen backbones, the input pipeline, the per-image embedding store
and the `extract` command that turns them into client caches."""
