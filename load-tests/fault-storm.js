// The mock fails 20% with 503, 10% with 429 (Retry-After 1 s) and 5% with resets, on a
// route with two targets. Clients should mostly succeed, and no request may make more
// than max_attempts x targets = 6 upstream attempts (no amplification).
import http from 'k6/http';
import { check } from 'k6';
import { Trend, Rate } from 'k6/metrics';
import { BACKSTOP, DURATION, RATE, chat, headers } from './lib.js';

const attempts = new Trend('backstop_attempts');
const success = new Rate('client_success');
const storm = 'status=503@0.2|status=429;retry_after=1@0.1|reset@0.05';

export const options = {
  scenarios: {
    storm: { executor: 'constant-arrival-rate', rate: Math.max(10, Math.floor(RATE / 4)), timeUnit: '1s', duration: DURATION, preAllocatedVUs: 50, maxVUs: 400 },
  },
  thresholds: {
    backstop_attempts: ['max<=6'],
    client_success: ['rate>0.9'],
    checks: ['rate>0.999'],
  },
};

export default function () {
  const res = http.post(`${BACKSTOP}/v1/chat/completions`, chat(), { headers: headers({ 'x-mock-fault-mix': storm }) });
  const n = parseInt(res.headers['X-Backstop-Attempts'] || '0', 10);
  attempts.add(n);
  success.add(res.status === 200);
  check(res, {
    'attempts header present': () => n >= 1,
    'failures say not to retry': (r) => r.status === 200 || r.headers['X-Should-Retry'] === 'false',
  });
}
