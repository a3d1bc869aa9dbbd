"""`plandsl profile`: measure this machine through torch and write it as a cluster file of the language.

`measure` times GEMMs, a memory copy and collectives (torch); `results` holds what was measured with its
spread; `write` fits the cost model's knobs (`cost.fit`) and writes the file; `job` checks the options,
runs the measurement (here, or on ranks started by torch's launcher, `rank`) and writes atomically.
"""
