"""Example model repositories for pdserve and the script that builds them (``build.py``)."""
