"""The rank-group primitives that layers and models use, below the models: the tensor-parallel
group (group.py), how a checkpoint tensor is cut for a rank (shard.py), the sharded layers
(layers.py), which layers a pipeline stage holds (stage.py) and which rank does what
(topology.py). The multi-process runtime that drives runners on those ranks is engine.ranks."""
