-- wrk script for benches/overhead.sh: POST a ~1 KB chat-completions request, as an SDK would.
-- The body comes from the file named by OVERHEAD_PAYLOAD (default: payload.json beside this script).
local path = os.getenv("OVERHEAD_PAYLOAD") or "benches/overhead/payload.json"
local f = assert(io.open(path, "rb"), "cannot open payload " .. path)
local body = f:read("*a"):gsub("%s+$", "")
f:close()

wrk.method = "POST"
wrk.body = body
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer sk-overhead-bench"
