"""What the tests share, apart from the tests themselves: the fake WorkerGroup for the Controller's unit tests
(``fake_group.py``), the multi-process harness (``distributed_harness.py``), a Ray head of a test's own
(``ray_head.py``), job builders and readers of a run's outputs (``helpers.py``), and the workloads tests train
(``user_workload.py``, ``hf_workload.py``, ``fault_workloads.py``, ``nan_workload.py``, ``stall_workload.py``)."""
