"""Between the application and the engine: prompt processing, detokenization, output assembly."""
