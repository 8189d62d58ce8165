"""How long a run takes and what it costs, on demand and on spot, and how often to
checkpoint on spot (issue 45; tools/estimate_cost.py is its command line).

plan.py: the arithmetic (time from the MFU's FLOPs per token; spot's expected preemptions,
lost work and total time; Young/Daly's interval). prices.py and prices.yaml: published
prices by GPU kind. measured.py: the MFU and save rate a cluster check measured.
estimate.py: the inputs resolved from the flags, and the printed plan.
"""
