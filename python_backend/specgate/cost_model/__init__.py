"""Whether speculation pays, and how much to draft: the economics of speculative decoding in one place.

- measuring (`measure.py`): the machine's verification cost curve cost(T) and each drafter's drafting
  time, checked against a bare decode loop; `calibrate()` turns them into the calibration spec_engine
  publishes (`calibration.py`, the record the gate reads);
- learning (`live.py`): the curve corrected by every verification spec_engine serves;
- deciding (`goodput.py`, the arithmetic the engine and the gate share): each step's draft budget
  (`choose_budget`), the expected speedup of an algorithm at an acceptance, and where drafting stops
  paying; and (`route.py`) what the gate takes from a calibration: `auto`'s algorithm, `no_gain`, the
  breaker's thresholds.

"Why did the gate send this request to baseline" is answered here and in gate/decision.py and gate/router.py.
Layering: this package uses decoding (targets, trees, sampling, engine config) and nothing above it;
speculative/ and gate/ use it (tests/unit/test_layout.py).
"""
