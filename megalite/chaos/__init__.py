"""A fault campaign (docs/design.md §26): tools/chaos.py trains a tiny job under a restart
policy and injects faults from a seeded schedule; each ends as "survived" (the final
weights and optimizer state bit-identical to the fault-free run's), "clear-error" (stopped
by an error naming the fault) or "silent" (neither: must never happen).

faults.py: the kinds of fault and the schedule; inject.py: the in-rank half (the entry
point torchrun starts, wrapping megalite functions to fault at a chosen phase and step);
job.py: launching the job and signalling its processes; campaign.py: one run's faults
driven from its log; report.py: outcomes, comparison with the fault-free run, the report.
Nothing in megalite's training path imports this package.
"""
