"""Stopping a child process. No Django here: bench/run.py imports it too."""
import subprocess


def stop_process(process: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited after ``timeout`` seconds (then wait up
    to 5 s more). A process that already exited is left as it is."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
