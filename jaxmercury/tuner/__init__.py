"""The autotuner: design space, cost model, measurement and the tuning database."""

from jaxmercury.tuner.cost import Machine, predict
from jaxmercury.tuner.database import Database
from jaxmercury.tuner.memory import memory_per_device
from jaxmercury.tuner.space import enumerate_schedules
from jaxmercury.tuner.tune import TuneResult, autotune, predict_candidates

__all__ = ["Database", "Machine", "TuneResult", "enumerate_schedules", "memory_per_device", "predict", "predict_candidates", "autotune"]
