"""Published scaling figures to hold a measured one against: ResNet-50's speed-up over one GPU on GPUs linked by
NVSwitch (NVIDIA's DGX A100) and on GeForce cards over PCIe (RTX 3090), and the nearest of them to a run
(``nearest``). Pure and torch-free; the figures as their sources print them.

Sources:

- NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md, "Training performance: NVIDIA
  DGX A100 (8x A100 80GB)" (pytorch-21.03 NGC container): 938 img/s on 1 GPU, 7248 on 8 in TF32 (7.72x); 2470 and
  16621 with mixed precision (6.72x).
- server-gear.com, "RTX3090 x8 exhaustive tf_cnn_benchmarks" (TensorFlow 20.12-tf1 NGC container, fp16, an AMD EPYC
  server, the cards on PCIe): ResNet-50 at 64, 128, 256 and 512 images per GPU on 1, 2, 4 and 8 GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Published:
    setup: str  # for a person: the model, the GPUs and how they are linked, the precision
    nvlink: bool  # linked by NVLink/NVSwitch (else PCIe)
    mixed: bool  # mixed precision (fp16/bf16) rather than fp32/tf32
    per_gpu_batch: int | None  # images per GPU, where the source gives it
    speedups: dict[int, float]  # GPUs -> the speed-up over one GPU


_DGX = "ResNet-50 v1.5 on a DGX A100 (A100 80GB, NVSwitch), PyTorch"
_RTX = "ResNet-50 on RTX 3090s over PCIe, TensorFlow, fp16"
FIGURES = (
    Published(f"{_DGX}, TF32", True, False, None, {8: 7.72}),
    Published(f"{_DGX}, mixed precision", True, True, None, {8: 6.72}),
    Published(_RTX, False, True, 64, {2: 1.780, 4: 2.725, 8: 3.934}),
    Published(_RTX, False, True, 128, {2: 1.867, 4: 3.192, 8: 5.330}),
    Published(_RTX, False, True, 256, {2: 1.932, 4: 3.610, 8: 6.230}),
    Published(_RTX, False, True, 512, {2: 1.968, 4: 3.847, 8: 7.266}),
)


def nearest(nvlink: bool, mixed: bool, gpus: int, per_gpu_batch: float) -> str | None:
    """The published figure nearest to a run on ``gpus`` GPUs: the same kind of link first, then the same precision,
    the nearest batch per GPU and the nearest count of GPUs (both by ratio); None for one GPU. As one phrase:
    "ResNet-50 on RTX 3090s over PCIe, TensorFlow, fp16, 64 images per GPU: 1.78x on 2 GPUs (89%)"."""
    if gpus < 2:
        return None

    def distance(figure: Published) -> tuple[bool, bool, float]:
        batch = abs(math.log(per_gpu_batch / figure.per_gpu_batch)) if figure.per_gpu_batch and per_gpu_batch else 0
        return figure.nvlink != nvlink, figure.mixed != mixed, batch

    figure = min(FIGURES, key=distance)
    count = min(figure.speedups, key=lambda n: (abs(math.log(n / gpus)), n))
    gain = figure.speedups[count]
    batch = f", {figure.per_gpu_batch} images per GPU" if figure.per_gpu_batch else ""
    return f"{figure.setup}{batch}: {gain:.2f}x on {count} GPUs ({gain / count:.0%})"
