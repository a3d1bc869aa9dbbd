"""The parallelisms of the interpreter, each a function over torch modules and the plan's DeviceMesh:
mesh, tensor/sequence, data (DDP/FSDP2/ZeRO-1), context, expert, pipeline stages, recomputation."""
