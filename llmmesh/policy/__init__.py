"""The policy engine as a library: rule sets and their inheritance, the input check of
everything a model will read, the streamed output check, detectors by name, and the
rules' wire form. The policy service and the router use it through this module.

    rules = RuleSet.from_file(path)
    verdict = check_input(rules, [Part("messages[0].content", text)]).verdict(rules)
    check = StreamCheck(rules.output, on_decision=print)
    step = check.feed("generated text", final=True)
"""

from llmmesh.policy.detectors import DETECTORS, Detector, register_detector
from llmmesh.policy.library import DEFAULT_SET, RuleLibrary
from llmmesh.policy.parts import PART_SEPARATOR, Part, PartsDecision, check_input
from llmmesh.policy.rules import (
    DEFAULT_HOLDBACK_CAP,
    RuleSet,
    RuleSetError,
    RuleSetSpec,
    RuleSpec,
    StageRules,
)
from llmmesh.policy.schema import SCHEMA_VERSION, dump_rules, load_rules
from llmmesh.policy.streaming import OutputDecision, OutputScanner, OutputStep, StreamCheck

__all__ = [
    "DEFAULT_HOLDBACK_CAP",
    "DEFAULT_SET",
    "DETECTORS",
    "PART_SEPARATOR",
    "SCHEMA_VERSION",
    "Detector",
    "OutputDecision",
    "OutputScanner",
    "OutputStep",
    "Part",
    "PartsDecision",
    "RuleLibrary",
    "RuleSet",
    "RuleSetError",
    "RuleSetSpec",
    "RuleSpec",
    "StageRules",
    "StreamCheck",
    "check_input",
    "dump_rules",
    "load_rules",
    "register_detector",
]
