"""How a job reaches Ray: connection, the driver-side run and the CLI (the configuration is ``jobconfig``).
The public API is ``raylastic``'s (``from raylastic import JobConfig, train``)."""
