"""The autotuner: design space, cost model, measurement and the tuning database."""

from jaxmercury.analysis.memory import memory_per_device
from jaxmercury.tuner.autotuner import TuneInterrupted, TuneResult, autotune, predict_candidates
from jaxmercury.tuner.candidates import Candidate
from jaxmercury.tuner.config import TuneConfig
from jaxmercury.tuner.cost import Machine, predict
from jaxmercury.tuner.database import Database
from jaxmercury.tuner.space import enumerate_schedules

__all__ = ["Candidate", "Database", "Machine", "TuneConfig", "TuneInterrupted", "TuneResult", "autotune",
           "enumerate_schedules", "memory_per_device", "predict", "predict_candidates"]
