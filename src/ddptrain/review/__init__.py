"""Reading a run from outside: the report and story of a run folder, the verdict of a hang, the doctor's bring-up checks."""
