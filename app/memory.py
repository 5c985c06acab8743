"""Memory sampling in a background thread, read by a gr.Timer outside the generation queue.

On a GPU: NVML's used/total for the device (which counts every process) next to torch's own
allocation (this process only). Without a driver NVML fails to initialise; we then show the
process's resident memory from psutil and say so.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import psutil
import torch


class MemorySampler:
    def __init__(self, interval: float = 0.5, keep: int = 240):
        self.interval = interval
        self.samples: deque[dict] = deque(maxlen=keep)
        self._handle = None
        self.source = "process RSS (CPU, no GPU)"
        if torch.cuda.is_available():
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
                self.source = f"GPU {torch.cuda.get_device_name()} (NVML) + torch allocated"
            except Exception:  # noqa: BLE001 - no driver / no NVML: fall back to RSS
                self._handle = None
        self._process = psutil.Process()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def sample(self) -> dict:
        mib = 1024 * 1024
        if self._handle is not None:
            info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
            return {
                "t": time.time(),
                "used_mb": info.used / mib,
                "total_mb": info.total / mib,
                "torch_mb": torch.cuda.memory_allocated() / mib,
            }
        return {"t": time.time(), "used_mb": self._process.memory_info().rss / mib}

    def start(self) -> "MemorySampler":
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
                self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            self.samples.append(self.sample())
            time.sleep(self.interval)

    def snapshot(self) -> list[dict]:
        return list(self.samples)


SAMPLER = MemorySampler()
