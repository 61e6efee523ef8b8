"""The multi-process runtime of ``--tp-size`` x ``--pp-size``, above the runner: starting the ranks
(launch.py), a rank's place in the world and joining it (world.py), the store where ranks and
nodes meet (rendezvous.py), a worker rank's loop (worker.py), rank 0's runner that drives them
(executor.py), what it sends per forward (messages.py) and the micro-batched pipeline step
(pipeline.py). The primitives the models use are engine.parallel, below the models."""
