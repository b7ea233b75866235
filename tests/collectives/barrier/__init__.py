"""Tests of collectives.barrier (partial, semaphore and throttled barriers; service, client, harness)."""
