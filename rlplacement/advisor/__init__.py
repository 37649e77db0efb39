"""The placement advisor: telemetry -> measurement -> diagnosis -> step-time model -> recommendation.

Pure functions apart from :mod:`.cli` (argument handling, printing) and :mod:`.plot` (matplotlib).
"""

from rlplacement.advisor.diagnose import DIAGNOSES, Diagnosis, diagnose
from rlplacement.advisor.measure import Measurement, Placement, measure
from rlplacement.advisor.model import Prediction, StepModel, Workload, fit
from rlplacement.advisor.recommend import Advice, candidate_placements, recommend
from rlplacement.advisor.thresholds import ModelAssumptions, Thresholds

__all__ = ["DIAGNOSES", "Advice", "Diagnosis", "Measurement", "ModelAssumptions", "Placement", "Prediction",
           "StepModel", "Thresholds", "Workload", "candidate_placements", "diagnose", "fit", "measure", "recommend"]
