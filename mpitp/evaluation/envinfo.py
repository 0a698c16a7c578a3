"""lm-eval's environment record (torch's ``collect_env``), computed early and away from the working directory."""

from __future__ import annotations


def env_info_isolated() -> str:
    """torch's ``collect_env`` text, computed in an isolated child (:mod:`mpitp.isolated`) that runs in an empty
    private folder: ``collect_env`` starts ``python -mpip list``, which puts its working directory first on
    ``sys.path``, so from a shared job folder a planted ``pip.py`` would run as the user."""
    import subprocess
    import tempfile

    from mpitp.isolated import python_argv

    code = "import sys, torch.utils.collect_env as c; sys.stdout.write(c.get_pretty_env_info())"
    with tempfile.TemporaryDirectory(prefix="mpitp-env-") as empty:
        done = subprocess.run(python_argv(code), cwd=empty, capture_output=True, text=True, timeout=300,
                              stdin=subprocess.DEVNULL)
    return done.stdout if done.returncode == 0 else f"(collect_env failed: exit {done.returncode})"


class EnvInfoEarly:
    """lm-eval's ``simple_evaluate`` ends with ``add_env_info``, which runs torch's ``collect_env`` (``pip list``,
    ``lscpu`` and more as subprocesses: 1-14 s measured here) on rank 0 after the last request, while every other
    rank waits. Start it in a thread as the evaluation starts (rank 0 mostly waits for chunks then) and hand lm-eval
    that same text when it asks; the stored environment info is unchanged (computed in an isolated child:
    :func:`env_info_isolated`)."""

    def __enter__(self):
        import concurrent.futures

        from mpitp import compat

        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mpitp-env-info")
        self.future = self.pool.submit(env_info_isolated)
        self.patch = compat.replaced("get_pretty_env_info", lambda: self.future.result())
        self.patch.__enter__()
        return self

    def __exit__(self, *exc):
        self.patch.__exit__(*exc)
        self.pool.shutdown(wait=False)
