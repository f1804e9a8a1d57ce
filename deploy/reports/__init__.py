"""What a run shows: the live view while it runs, the report and its HTML page after."""
