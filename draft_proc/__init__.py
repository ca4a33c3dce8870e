"""The draft process: owns the draft model, answers SpecRequests, keeps the SSD tree cache."""
