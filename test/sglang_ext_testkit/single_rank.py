"""A world of one for GPU tests and benchmarks that build sglang models outside a server."""

from __future__ import annotations


def init_single_rank_parallel_state() -> None:
    """World of one (gloo), so sglang's parallel layers find their TP group; idempotent."""
    import inspect
    import socket

    from sglang.srt.distributed import parallel_state

    if parallel_state._TP is not None:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    parallel_state.init_distributed_environment(
        world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    sizes = inspect.signature(parallel_state.initialize_model_parallel).parameters
    # 0.5.23 takes no widths: it reads the published runtime settings (tensor parallel 1 by default)
    parallel_state.initialize_model_parallel(**({"tensor_model_parallel_size": 1} if "tensor_model_parallel_size" in sizes
                                                else {}))


def release_single_rank_parallel_state() -> None:
    """Undo init_single_rank_parallel_state: processes this one forks later start without a world."""
    import torch.distributed as dist

    from sglang.srt.distributed import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()
    if dist.is_initialized():
        dist.destroy_process_group()
