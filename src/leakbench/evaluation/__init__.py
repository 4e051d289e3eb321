"""The systematic evaluation: sweep specs, trials, runners, the results store, utility, strongest attack."""

from .trials.plan import defense_family, plan
from .running.run import run_trial
from .sweep_spec.model import SweepSpec, load_spec
from .store import Store
from .verdicts.strongest import AttackScore, Strongest, strongest
from .verdicts.rules import PrivacyUtilityPoint, privacy_utility
from .verdicts.utility import utility_table
from .sweep import Sweep, SweepSummary, evaluate
from .trials.trial import TrialResult, TrialSpec
from .training.utility import TrainResult, UtilityResult, train_model  # utility(): in .utility (a same name would shadow it)
