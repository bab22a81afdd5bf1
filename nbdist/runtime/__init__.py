"""Code that runs on the workers: stdlib, torch, cloudpickle and psutil only (never IPython)."""
