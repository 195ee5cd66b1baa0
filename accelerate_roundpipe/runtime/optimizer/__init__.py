"""The optimizer the user holds, the step policies its thread follows, and refusing steps the engine does not take."""
