"""process_results of the ``mpitp_slow_metrics_mc`` test task: lm-eval's accuracy, after ``stall_hook("metrics")``
(``MPITP_TEST_STALL=metrics:<s>`` makes rank 0's metrics phase last as long as a drill needs)."""

from mpitp.evaluation.dispatch import stall_hook


def process_results(doc, results):
    stall_hook("metrics")
    lls = [ll for ll, _ in results]
    return {"acc": float(max(range(len(lls)), key=lls.__getitem__) == doc["answer"])}
