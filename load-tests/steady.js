// Constant arrival rate through Backstop, every policy layer on (session header, budgets,
// guard, breaker, retry, metrics). Targets: no failed requests, p99 well under the bar.
import http from 'k6/http';
import { check } from 'k6';
import { BACKSTOP, DURATION, RATE, chat, headers, latency } from './lib.js';

export const options = {
  scenarios: {
    steady: { executor: 'constant-arrival-rate', rate: RATE, timeUnit: '1s', duration: DURATION, preAllocatedVUs: 50, maxVUs: 400 },
  },
  thresholds: Object.assign({
    http_req_failed: ['rate<0.001'],
    checks: ['rate>0.999'],
  }, latency({
    // Loopback to an instant mock: a p99 over 25 ms means Backstop is the bottleneck.
    http_req_duration: ['p(99)<25'],
  })),
};

export default function () {
  const res = http.post(`${BACKSTOP}/v1/chat/completions`, chat(), { headers: headers({ 'x-session-id': `steady-${__VU}` }) });
  check(res, {
    'status 200': (r) => r.status === 200,
    'one upstream attempt': (r) => r.headers['X-Backstop-Attempts'] === '1',
  });
}
