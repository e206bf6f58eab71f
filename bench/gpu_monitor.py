"""The NVML sampler against known allocations, on a machine with a GPU (run it there).

While `build.py monitor` samples every 50 ms, this process holds 8 GiB, adds 2 GiB for 150 ms,
then releases both. The expected peak is NVML's own `used` (v1, as nvidia-smi) read by this
process while the 2 GiB are held; the monitor's peak must be within 64 MiB of it.
Run: python bench/gpu_monitor.py
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pynvml
import torch

ROOT = Path(__file__).resolve().parent.parent
GiB = 2**30

pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByIndex(0)


def used() -> int:
    return pynvml.nvmlDeviceGetMemoryInfo(handle).used


torch.cuda.init()
torch.zeros(1, device="cuda")  # the CUDA context exists before the monitor's baseline
torch.cuda.synchronize()
idle = used()
monitor = subprocess.Popen([sys.executable, str(ROOT / "build.py"), "monitor", "--seconds", "6", "--json"],
                           cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
time.sleep(1.5)
held = torch.ones(8 * GiB // 4, dtype=torch.float32, device="cuda")  # written, so the pages are committed
torch.cuda.synchronize()
time.sleep(1.0)
with_8 = used()
burst = torch.ones(2 * GiB // 4, dtype=torch.float32, device="cuda")
torch.cuda.synchronize()
expected_peak = used()
time.sleep(0.15)
del burst
torch.cuda.synchronize()
torch.cuda.empty_cache()
time.sleep(1.0)
del held
torch.cuda.empty_cache()
out, err = monitor.communicate(timeout=60)
if monitor.returncode != 0:
    sys.exit(f"monitor failed: {err}")
gpu = json.loads(out)["gpu"]
error = gpu["peak_used_bytes"] - expected_peak
print(f"device: {gpu['name']}, total {gpu['total_bytes'] / GiB:.2f} GiB, {gpu['samples']} samples in 6 s "
      f"({gpu['samples'] / 6:.1f}/s)")
print(f"used idle (context up): {idle / GiB:.3f} GiB; with 8 GiB held: {with_8 / GiB:.3f} GiB "
      f"(+{(with_8 - idle) / GiB:.3f})")
print(f"expected peak (8 + 2 GiB, read by the allocating process): {expected_peak / GiB:.4f} GiB")
print(f"monitor peak: {gpu['peak_used_bytes'] / GiB:.4f} GiB; difference {error / 2**20:+.1f} MiB "
      f"(limit 64 MiB): {'PASS' if abs(error) <= 64 * 2**20 else 'FAIL'}")
print(f"monitor min margin: {gpu['min_margin_bytes'] / GiB:.3f} GiB")
sys.exit(0 if abs(error) <= 64 * 2**20 else 1)
