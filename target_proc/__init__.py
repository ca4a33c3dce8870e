"""The target process: owns the target model, verifies speculations, decides what text is final."""
