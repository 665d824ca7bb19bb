"""The SLA planner: sizes the prefill and decode pools from demand, profiled capacity and latency.

Pure Python (no torch, no Kubernetes client): `law.plan` is a function from one tick's
observation and the previous state to a decision, so it is tested on plain objects and driven
by the simulator (bench/planner_sim.py) with the same code that runs live.
"""
