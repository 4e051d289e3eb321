"""The systematic evaluation: sweep specs, trials, runners, the results store, utility, strongest attack."""

from .plan import defense_family, plan
from .run import run_trial
from .spec import SweepSpec, load_spec
from .store import Store
from .strongest import AttackScore, PrivacyUtilityPoint, Strongest, privacy_utility, strongest, utility_table
from .sweep import Sweep, SweepSummary, evaluate
from .trial import TrialResult, TrialSpec
from .utility import TrainResult, UtilityResult, train_model  # utility(): in .utility (a same name would shadow it)
