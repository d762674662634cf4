"""Adapters for the frameworks people train with, through each framework's public extension
points (docs/integrations.md names the few private details they rely on, and the versions the
``integrations`` extra is bounded to); each calls overlapkit's public API only.

- ``overlapkit.integrations.lightning``: ``OverlapDDPStrategy`` (``strategy="overlapkit_ddp"``)
  wraps with ``ok.ddp`` on every backend; ``ok.fsdp`` goes in ``configure_model`` under
  Lightning's ``ModelParallelStrategy``.
- ``overlapkit.integrations.accelerate``: ``OverlapDDPKwargs``, a kwargs handler that puts
  ``ok.ddp``'s hook on the DDP model ``Accelerator.prepare`` builds.
- ``overlapkit.integrations.hf_trainer``: ``OverlapTrainer``, a ``transformers.Trainer`` that
  does the same for the model ``Trainer.train()`` wraps.

Each also offers per-bucket optimizer updates without DDP (``ok.GradBucketer(model,
optimizer=opt)``, the framework's own clipping folded in): ``OverlapDDPStrategy(
optimizer_overlap=True)``, ``use_ok_ddp(accelerator, optimizer_overlap=True)``
(``overlapkit.integrations.accelerate_per_bucket``) and ``OverlapTrainer(overlapkit_options=
{"optimizer_overlap": True})``.

The frameworks are optional (``pip install overlapkit[integrations]``); importing this package
imports none of them.
"""
