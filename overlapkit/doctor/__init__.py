"""``overlapkit doctor``: a checklist of a distributed-training setup, measured where it runs."""

from overlapkit.doctor.check import CHECK_NAMES, Check, exit_code
from overlapkit.doctor.runner import DoctorOptions, run_doctor
from overlapkit.doctor.scaling import scaling_efficiency

__all__ = ["CHECK_NAMES", "Check", "DoctorOptions", "exit_code", "run_doctor", "scaling_efficiency"]
