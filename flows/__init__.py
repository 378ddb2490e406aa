"""The Prefect layer: flows, the CLI and the commands around them."""
import os

# Prefect reads its settings once, when it is first imported, and every entry point here (`lmforge`, a script that
# imports flows.pipeline) imports this package first. Prefect's ephemeral API server gets 20 s to start by default;
# on a loaded machine it often needs more. Its loop counts only its own sleeps, so this is a lower bound. Setting the
# variable yourself decides instead.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
