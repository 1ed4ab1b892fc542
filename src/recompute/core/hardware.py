"""GPUs as data rows: memory, dense matmul peaks by dtype, bandwidths, links, and how much of the memory a step
can use.

Each row names its sources. ``memory`` is the total the driver reports (``nvidia-smi``'s ``memory.total``,
which is also what ``torch.cuda.get_device_properties(i).total_memory`` reports), not the marketing figure:
an "80GB" H100 reports 81559 MiB. ``peak_bf16`` is the dense (no 2:4 sparsity) bf16 tensor-core rate with
fp32 accumulation from the vendor's datasheet. ``intra`` and ``inter`` are the GPU's links to the GPUs of its
node (NVLink through NVSwitch, Infinity Fabric, or PCIe) and to other nodes (its own InfiniBand/RoCE adapter),
each with its datasheet bandwidth per direction and NCCL's latency per ring step (``recompute.core.comms``).
Torch-free: the planner and the report read this module.
"""

from __future__ import annotations

from dataclasses import dataclass

from recompute.core.comms import Link, Network
from recompute.core.errors import ConfigError
from recompute.core.table import GiB, MiB
from recompute.core.timing import Curve, Device

__all__ = [
    "BANDWIDTH_SHARE",
    "CONTEXT_RESERVE",
    "FRAGMENTATION",
    "GPU",
    "GPUS",
    "KERNEL_OVERHEAD",
    "MATMUL_SHARE",
    "datasheet_device",
    "datasheet_network",
    "gpu_by_name",
    "usable_bytes",
]


CONTEXT_RESERVE = 1 * GiB
"""Bytes the step cannot use whatever it does: the CUDA context (about 0.5 GiB with PyTorch's kernels loaded
on a Hopper GPU), cuBLAS/cuDNN workspaces and the allocator's first blocks. A stated allowance, not a
measurement of any one machine; NCCL buffers of a multi-GPU job come on top."""

FRAGMENTATION = 0.05
"""Share of the memory that PyTorch's caching allocator loses to fragmentation in a long training run: blocks
cached but not reusable for the next size asked for. An allowance; ``expandable_segments`` lowers it. The
allocator's replay on traced steps (``recompute.core.allocator``, docs/validation.md) predicts 2-31 % above the
allocated peak; ``plan --trace`` on CUDA checks that replay instead of this allowance."""

_SMI = "nvidia-smi memory.total as logged publicly"
_MODAL = "nvidia-smi memory.total per GPU type, modal-labs/modal-client PR #2797"
_LENT = "nvidia-smi memory.total on the H100 the device tool lends (81559 MiB)"
_PCIE4, _PCIE5 = 32e9, 64e9  # x16 per direction, as the PCI-SIG specifications state

_NCCL_LAT = "per-step latency: NCCL's tuning model, Simple protocol (NVIDIA/nccl src/graph/tuning.cc, commit b6475625)"
NVLINK3 = Link(
    "NVLink 3 (NVSwitch)",
    300e9,
    3.4e-6,
    f"NVIDIA A100 datasheet: NVLink 600 GB/s bidirectional, 300 per direction; {_NCCL_LAT}",
)
NVLINK4 = Link(
    "NVLink 4 (NVSwitch)",
    450e9,
    3.4e-6,
    f"NVIDIA H100/H200 datasheets: NVLink 900 GB/s bidirectional, 450 per direction; {_NCCL_LAT}",
)
NVLINK5 = Link(
    "NVLink 5 (NVSwitch)",
    900e9,
    3.4e-6,
    f"NVIDIA HGX B200 datasheet: NVLink 1.8 TB/s per GPU bidirectional, 900 per direction; {_NCCL_LAT}",
)
INFINITY_FABRIC = Link(
    "AMD Infinity Fabric (7 links)",
    448e9,
    3.4e-6,
    "AMD Instinct MI300X datasheet: 896 GB/s aggregate peer-to-peer Infinity Fabric (7 links of 128 GB/s "
    f"bidirectional), 448 per direction; NVLink's per-step latency assumed ({_NCCL_LAT})",
)
PCIE4_P2P = Link("PCIe Gen4 x16", _PCIE4, 5.7e-6, f"PCI-SIG Gen4 x16: 32 GB/s per direction; {_NCCL_LAT}")
PCIE5_P2P = Link(
    "PCIe Gen5 x16",
    _PCIE5,
    5.7e-6,
    f"PCI-SIG Gen5 x16: 64 GB/s per direction; {_NCCL_LAT}; bus bandwidth 40 GB/s, the middle of the 35-45 GB/s "
    "published for all-reduce on 8 H100 PCIe without NVSwitch (docs.alayanew.com, NCCL-tests in practice, 2026)",
    busbw=40e9,
)
IB_HDR = Link(
    "InfiniBand HDR 200 Gb/s per GPU",
    25e9,
    14e-6,
    "DGX A100 / Selene: eight 200 Gb/s HDR HCAs per node, one per GPU (Korthikanti et al. 2022, Sec. 6); " + _NCCL_LAT,
)
IB_NDR = Link(
    "InfiniBand NDR 400 Gb/s per GPU",
    50e9,
    14e-6,
    f"DGX H100/H200/B200 user guides: eight ConnectX-7 400 Gb/s adapters per node, one per GPU; {_NCCL_LAT}",
)
ETH_100 = Link(
    "Ethernet 100 Gb/s (RoCE) per GPU",
    12.5e9,
    14e-6,
    f"assumed for a workstation GPU (no datacenter adapter is part of the card); {_NCCL_LAT}",
)
_HGX_SWITCH = (
    "HGX boards put two GPUs (and two NICs) behind each PCIe switch, one x16 uplink to the host (DGX A100 user "
    "guide; nvidia-smi topo -m of an HGX B200: GPU0 and GPU1 PIX to the same NICs)"
)


@dataclass(frozen=True)
class GPU:
    """One accelerator model: memory, dense matmul peaks by dtype, memory bandwidth and host link."""

    name: str
    """Lower-case id used on the command line, e.g. ``h100-80gb``."""
    memory: int
    """Total device memory in bytes, as the driver reports it."""
    peak_bf16: float
    """Peak dense bf16 tensor-core FLOP/s (fp32 accumulation), from the datasheet."""
    label: str
    """Marketing name."""
    source: str
    """Where the figures come from."""
    peak_tf32: float = 0.0
    """Dense TF32 tensor-core FLOP/s (what an fp32 matmul gets with ``allow_tf32``)."""
    peak_fp32: float = 0.0
    """fp32 FLOP/s without tensor cores (PyTorch's default for fp32 matmuls on NVIDIA GPUs); the matrix-core
    fp32 rate on AMD."""
    bandwidth: float = 0.0
    """Device memory bandwidth, bytes per second."""
    host_link: float = _PCIE4
    """Host-to-device bandwidth per direction, bytes per second (the PCIe generation's x16 rate)."""
    kind: str = "cuda"
    """``cuda`` or ``rocm``: what ``torch`` calls the device either way is ``cuda``."""
    intra: Link = PCIE4_P2P
    """The link to the other GPUs of its node (``recompute.core.comms``)."""
    inter: Link = IB_HDR
    """The link to GPUs of other nodes, per GPU."""
    gpus_per_host_link: int = 1
    """GPUs behind one host link (a PCIe switch's uplink): when they all copy to the host at once (offload under
    any multi-GPU job) each gets ``host_link / gpus_per_host_link``."""
    links_source: str = ""
    """Where the host-link sharing comes from."""

    @property
    def peak_fp16(self) -> float:
        """Dense fp16 tensor-core FLOP/s: the bf16 rate on every GPU listed."""
        return self.peak_bf16


GPUS: dict[str, GPU] = {
    gpu.name: gpu
    for gpu in (
        GPU(
            "h100-80gb",
            81559 * MiB,
            989.4e12,
            "NVIDIA H100 SXM5 80GB",
            f"{_MODAL}; NVIDIA H100 datasheet (SXM: BF16 1,979 TFLOPS and TF32 989 with sparsity, FP32 67 TFLOPS, "
            "3.35 TB/s, PCIe Gen5)",
            peak_tf32=494.7e12,
            peak_fp32=66.9e12,
            bandwidth=3.35e12,
            host_link=_PCIE5,
            intra=NVLINK4,
            inter=IB_NDR,
            gpus_per_host_link=2,
            links_source=_HGX_SWITCH,
        ),
        GPU(
            "h100-pcie-80gb",
            81559 * MiB,
            756.5e12,
            "NVIDIA H100 PCIe 80GB",
            f"{_LENT}, assumed the same for the PCIe card; NVIDIA H100 datasheet (PCIe: BF16 1,513 TFLOPS and TF32 "
            "756 with sparsity, FP32 51 TFLOPS, 2 TB/s, PCIe Gen5)",
            peak_tf32=378e12,
            peak_fp32=51.2e12,
            bandwidth=2.0e12,
            host_link=_PCIE5,
            intra=PCIE5_P2P,
            inter=IB_NDR,
        ),
        GPU(
            "h200-141gb",
            143771 * MiB,
            989.4e12,
            "NVIDIA H200 141GB",
            f"{_SMI} (H200 NVL); NVIDIA H200 datasheet (SXM: BF16 1,979 TFLOPS and TF32 989 with sparsity, FP32 67 "
            "TFLOPS, 4.8 TB/s, PCIe Gen5)",
            peak_tf32=494.7e12,
            peak_fp32=66.9e12,
            bandwidth=4.8e12,
            host_link=_PCIE5,
            intra=NVLINK4,
            inter=IB_NDR,
            gpus_per_host_link=2,
            links_source=_HGX_SWITCH,
        ),
        GPU(
            "b200-180gb",
            183359 * MiB,
            2.25e15,
            "NVIDIA B200 180GB",
            f"{_SMI}; NVIDIA HGX B200 datasheet (per GPU: FP16/BF16 4.5 PFLOPS and TF32 2.2 with sparsity, 8 TB/s); "
            "FP32 without tensor cores 80 TFLOPS from NVIDIA's Blackwell architecture brief; PCIe Gen5 hosts",
            peak_tf32=1.1e15,
            peak_fp32=80e12,
            bandwidth=8.0e12,
            host_link=_PCIE5,
            intra=NVLINK5,
            inter=IB_NDR,
            gpus_per_host_link=2,
            links_source=_HGX_SWITCH,
        ),
        GPU(
            "a100-80gb",
            81920 * MiB,
            312e12,
            "NVIDIA A100 SXM4 80GB",
            f"{_MODAL}; NVIDIA A100 datasheet (BF16 312 TFLOPS, 624 with sparsity; TF32 156; FP32 19.5; 2,039 GB/s; "
            "PCIe Gen4)",
            peak_tf32=156e12,
            peak_fp32=19.5e12,
            bandwidth=2.039e12,
            intra=NVLINK3,
            inter=IB_HDR,
            gpus_per_host_link=2,
            links_source=_HGX_SWITCH,
        ),
        GPU(
            "a100-40gb",
            40960 * MiB,
            312e12,
            "NVIDIA A100 40GB",
            f"{_MODAL}; NVIDIA A100 datasheet (BF16 312 TFLOPS, 624 with sparsity; TF32 156; FP32 19.5; 1,555 GB/s; "
            "PCIe Gen4)",
            peak_tf32=156e12,
            peak_fp32=19.5e12,
            bandwidth=1.555e12,
            intra=NVLINK3,
            inter=IB_HDR,
            gpus_per_host_link=2,
            links_source=_HGX_SWITCH,
        ),
        GPU(
            "l40s-48gb",
            46068 * MiB,
            362.05e12,
            "NVIDIA L40S 48GB",
            f"{_MODAL}; NVIDIA L40S datasheet (BF16 362.05 TFLOPS, 733 with sparsity; TF32 183; FP32 91.6; 864 GB/s; "
            "PCIe Gen4)",
            peak_tf32=183e12,
            peak_fp32=91.6e12,
            bandwidth=864e9,
            intra=PCIE4_P2P,
            inter=IB_NDR,
        ),
        GPU(
            "rtx4090-24gb",
            24564 * MiB,
            165.2e12,
            "NVIDIA GeForce RTX 4090 24GB",
            f"{_SMI} (RLinf/RLinf issue #255); NVIDIA Ada Lovelace whitepaper (BF16 with FP32 accumulate 165.2 "
            "TFLOPS, TF32 82.6, FP32 82.6, 1,008 GB/s, PCIe Gen4)",
            peak_tf32=82.6e12,
            peak_fp32=82.6e12,
            bandwidth=1.008e12,
            intra=PCIE4_P2P,
            inter=ETH_100,
        ),
        GPU(
            "mi300x-192gb",
            196288 * MiB,
            1307.4e12,
            "AMD Instinct MI300X 192GB",
            "rocm-smi VRAM total as logged publicly (205,822,885,888 bytes); AMD Instinct MI300X datasheet (BF16 "
            "1,307.4 TFLOPS dense, TF32 653.7, FP32 matrix 163.4, 5.3 TB/s, PCIe Gen5)",
            peak_tf32=653.7e12,
            peak_fp32=163.4e12,
            bandwidth=5.3e12,
            host_link=_PCIE5,
            kind="rocm",
            intra=INFINITY_FABRIC,
            inter=IB_NDR,
        ),
    )
}


MATMUL_SHARE = 0.8
"""Share of the datasheet's dense matmul peak a large matmul reaches: 798 of 989 TFLOP/s for an 8192-cube bf16
product on the lent H100 SXM (``/work/.library/device/KINDS.md``, and ``recompute calibrate`` there,
benchmarks/results/time_model_gpu.json). A stated allowance for a row not calibrated."""

BANDWIDTH_SHARE = 0.9
"""Share of the datasheet's memory bandwidth a large copy reaches (3.0 of 3.35 TB/s on the same H100)."""

KERNEL_OVERHEAD = 6e-6
"""Seconds of host work per eager PyTorch kernel on a GPU (dispatch plus launch); ``recompute calibrate``
measures it."""


def datasheet_device(gpu: str | GPU) -> Device:
    """A roofline ``Device`` from a table row: flat rate curves at the datasheet peaks times the shares above.

    An uncalibrated prediction: small ops run below these rates, so it is optimistic for small models; use
    ``recompute calibrate`` on the device for figures to trust.
    """
    row = gpu_by_name(gpu)
    matmul = {"bfloat16": row.peak_bf16, "float16": row.peak_fp16, "float32": row.peak_fp32 or row.peak_bf16 / 16}
    compute = {f"matmul.{dt}": Curve.flat(MATMUL_SHARE * r) for dt, r in matmul.items()}
    memory = Curve.flat(BANDWIDTH_SHARE * row.bandwidth)
    return Device(
        name=row.name,
        kind=row.kind,
        label=row.label,
        compute=compute,
        bandwidth={"memory": memory, "math": memory},
        overhead=KERNEL_OVERHEAD,
        host_link=row.host_link,
        memory=row.memory,
        source=f"datasheet: {row.source}; matmul at {MATMUL_SHARE:.0%} and bandwidth at {BANDWIDTH_SHARE:.0%} of peak",
        network=datasheet_network(row).to_dict(),
    )


def datasheet_network(gpu: str | GPU, gpus_per_node: int = 8) -> Network:
    """The links of a table row as a ``Network`` (nothing measured)."""
    row = gpu_by_name(gpu)
    return Network(row.intra, row.inter, gpus_per_node)


def gpu_by_name(name: str | GPU) -> GPU:
    """The GPU row for ``name`` (case-insensitive); a GPU passes through.

    Raises:
        ConfigError: unknown name; the message lists the known GPUs.
    """
    if isinstance(name, GPU):
        return name
    key = name.strip().lower()
    if key not in GPUS:
        raise ConfigError(f"{name!r} is not a known GPU; known GPUs: {', '.join(GPUS)}")
    return GPUS[key]


def usable_bytes(gpu: str | GPU, *, context: float = CONTEXT_RESERVE, fragmentation: float = FRAGMENTATION) -> float:
    """Bytes a training step may plan to use on ``gpu``: memory - context - fragmentation * memory.

    Example: an H100 80GB reports 79.65 GiB; less 1 GiB of context and 5 % for fragmentation leaves 74.67 GiB.

    Raises:
        ConfigError: unknown GPU name, or a reserve that leaves nothing.
    """
    row = gpu_by_name(gpu)
    usable = row.memory - context - fragmentation * row.memory
    if usable <= 0 or not 0 <= fragmentation < 1:
        raise ConfigError(
            f"the reserve (context {context / GiB:.2f} GiB, fragmentation {fragmentation:.0%}) leaves no memory "
            f"on {row.name}; lower it"
        )
    return usable
