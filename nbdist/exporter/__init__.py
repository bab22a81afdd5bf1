"""What ran since the group formed, and that record as a torchrun script."""
