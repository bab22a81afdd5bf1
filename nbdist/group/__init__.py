"""Who is in the job, and how nbdist's own calls reach it: the membership, push/pull, relaunch."""
