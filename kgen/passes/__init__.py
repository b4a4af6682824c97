"""The generator's passes, one small pure function each (Plan -> Plan), in pipeline order."""

from kgen.passes.pipeline import PASSES, run_pipeline

__all__ = ["PASSES", "run_pipeline"]
