"""Injected faults (the job's ``faults:`` list): the plan of which fault fires where, and firing it. Test and
demo machinery: a run without ``faults`` never fires one.

May import (of actors/): status, processes.
"""
