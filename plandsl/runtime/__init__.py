"""The interpreter: runs a checked plan on torch.distributed (imported only by `plandsl run`)."""
