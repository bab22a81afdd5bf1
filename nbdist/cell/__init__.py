"""One cell: submit, events into the Run, results or one error; stopping it; its end marks."""
