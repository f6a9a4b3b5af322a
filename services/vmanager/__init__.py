"""The vmanager: per-pod vcuda.sock servers and the vcuda.config files they write (see app.py)."""
