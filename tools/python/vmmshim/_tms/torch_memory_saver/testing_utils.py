"""What TMS's own test suite imports from it."""
import torch

from .utils import is_xpu  # noqa: F401


def get_device():
    return "cuda"


def empty_cache():
    torch.cuda.empty_cache()


def get_and_print_gpu_memory(message, gpu_id=0):
    """Device memory in use as NVML counts it (torch.cuda.device_memory_used), printed."""
    mem = torch.cuda.device_memory_used(gpu_id)
    print(f"GPU {gpu_id} memory: {mem / 1024 ** 3:.2f} GB ({message})")
    return mem
