"""Running one model on several processes: tensor parallelism over torch.distributed.

``parallel.py`` holds a rank's view (which heads, columns and vocabulary rows it owns, and the
collectives the model calls), ``sharding.py`` cuts LoRA weights to a rank's part (the model's own
weights are cut by its layers as they load, model/layers.py), and ``workers.py`` starts the worker
processes, keeps them in step with rank 0 and ends them (docs/scaling.md; engine/executor.py is
the engine's side).
"""
