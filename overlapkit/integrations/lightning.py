"""Lightning: a DDP strategy whose model is wrapped by ``ok.ddp``, on every backend.

Lightning's ``DDPStrategy`` registers ``ddp_comm_hook`` only when the device is CUDA
(``DDPStrategy._register_ddp_hooks``), so on CPU/gloo a hook passed to it is silently dropped.
``OverlapDDPStrategy`` builds the DDP model with ``ok.ddp`` instead (its hook, ``bucket_mb``,
``compress`` including bf16 on gloo, ``check_finite``); everything else is Lightning's
``DDPStrategy``. Importing this module registers the names ``"overlapkit_ddp"`` and
``"overlapkit_ddp_spawn"`` with Lightning's strategy registry.

FSDP2 needs no strategy of its own: Lightning's ``ModelParallelStrategy`` leaves sharding to
``LightningModule.configure_model``, where one line applies ``ok.fsdp``::

    def configure_model(self):
        ok.fsdp(self.net, mesh=self.device_mesh["data_parallel"], prefetch=1)

Example:
    >>> import overlapkit.integrations.lightning  # registers "overlapkit_ddp"
    >>> trainer = lightning.Trainer(strategy="overlapkit_ddp", accelerator="cpu", devices=2)
    >>> trainer = lightning.Trainer(strategy=OverlapDDPStrategy(compress="bf16"), devices=2)
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch.nn.parallel import DistributedDataParallel

from overlapkit.ddp.wrap import ddp

__all__ = ["OverlapDDPStrategy"]

_HOOK_ARGUMENTS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper")


class OverlapDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` with the model wrapped by ``ok.ddp``.

    Args:
        bucket_mb, compress, powersgd_options, check_finite, on_nonfinite: as in ``ok.ddp``.
        **kwargs: ``DDPStrategy``'s arguments (``start_method``, ``timeout``,
            ``process_group_backend``...) and DDP options (``find_unused_parameters``,
            ``static_graph``...), except the comm-hook ones, which ``ok.ddp`` replaces.

    Raises:
        ValueError: ``ddp_comm_hook``, ``ddp_comm_state`` or ``ddp_comm_wrapper`` was given.
    """

    strategy_name = "overlapkit_ddp"

    def __init__(
        self,
        *,
        bucket_mb: float | str | None = None,
        compress: str | None = None,
        powersgd_options: dict[str, Any] | None = None,
        check_finite: bool = False,
        on_nonfinite: str = "raise",
        **kwargs: Any,
    ) -> None:
        given = [name for name in _HOOK_ARGUMENTS if kwargs.get(name) is not None]
        if given:
            raise ValueError(
                f"OverlapDDPStrategy: {given} cannot be combined with overlapkit's hook; choose "
                "the hook with compress=None|'bf16'|'fp16'|'powersgd', or use DDPStrategy"
            )
        super().__init__(**kwargs)
        self._overlap_options = dict(
            bucket_mb=bucket_mb,
            compress=compress,
            powersgd_options=powersgd_options,
            check_finite=check_finite,
            on_nonfinite=on_nonfinite,
        )

    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        device_ids = self.determine_ddp_device_ids()
        # As DDPStrategy does: build DDP on a side stream on CUDA (PyTorch's CUDA notes).
        ctx = torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext()
        with ctx:
            return ddp(model, device_ids=device_ids, **self._overlap_options, **self._ddp_kwargs)

    def _register_ddp_hooks(self) -> None:
        """Nothing to add: ``ok.ddp`` registered its hook when it built the model."""

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"overlapkit_ddp"`` (subprocess launch) and ``"overlapkit_ddp_spawn"``."""
        for name, start_method in (("overlapkit_ddp", "popen"), ("overlapkit_ddp_spawn", "spawn")):
            if name not in strategy_registry:
                strategy_registry.register(
                    name,
                    cls,
                    description=f"ok.ddp strategy with start_method {start_method!r}",
                    start_method=start_method,
                )


OverlapDDPStrategy.register_strategies(StrategyRegistry)
